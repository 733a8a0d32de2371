"""Generation with DARTS corrections: the corrected model, the continuous-batching engine, sampling, text.

`darts_dist.generation.CorrectedLM` is also the import path the registered models of darts-dist 0.1 use.
"""

from darts_dist.generation.corrected_lm import CorrectedLM
from darts_dist.generation.engine import (ContinuousBatcher, Engine, EngineBusy, EngineStats, EngineStopped,
                                          EngineThread, Event, Finished, Sampling, SequenceRequest, Ticket)
from darts_dist.generation.text import Completion

__all__ = ["Completion", "ContinuousBatcher", "CorrectedLM", "Engine", "EngineBusy", "EngineStats", "EngineStopped",
           "EngineThread", "Event", "Finished", "Sampling", "SequenceRequest", "Ticket"]
