"""Recalibration from served traffic (`darts-dist recalibrate CONFIG --from-traffic DIR`).

The prompts a server captured (`serve.capture`) become calibration samples of the task whose correction
answered them: each task's prompts go to a JSONL in a run folder of their own, which the run's config names as
`data.traffic`, and calibration takes `calibration.traffic_share` of its samples from them (evenly spread over
the captured window, one client's share capped: `traffic_sample`), the rest from the calibration file as before. Those copies are private (0600 in a 0700 folder) and removed when
the recalibration ends, finished or not. The expert actors produce the targets as for any calibration;
the run is evaluated on the held-out sets and registered under the same model name, so the alias moves only
under the registry's rule, and a server following the alias moves with it.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

from darts_dist.config import RunConfig, updated
from darts_dist.errors import DartsError
from darts_dist.fsutil import atomic_file
from darts_dist.serve.capture import CapturedPrompt, read_traffic
from darts_dist.sources.data import traffic_count
from darts_dist.tracking.registry import registered_model_name

TRAFFIC_FOLDER = "traffic"  # in the recalibration's run folder: one JSONL of captured prompts per task
# Users' prompts: readable by the service's user only, as the capture keeps them, and removed when the
# recalibration ends (remove_traffic_copies).
PRIVATE_FOLDER, PRIVATE_FILE = 0o700, 0o600


def traffic_row(prompt: CapturedPrompt) -> dict:
    """A captured prompt as calibration reads it (`sources.data.traffic_rows`): its text, whether it is a chat, and a
    chat's messages where the capture kept them."""
    row = {"prompt": prompt.prompt, "chat": prompt.chat}
    return row if prompt.messages is None else {**row, "messages": prompt.messages}


def spread_over_time(prompts: list[CapturedPrompt], count: int) -> list[CapturedPrompt]:
    """`count` of the time-ordered `prompts`, evenly spaced over the whole captured window, oldest first: a burst of
    requests just before a recalibration gets its share of the window, not every sample (the most recent would give
    about num_samples × traffic_share requests naming one task the whole of its traffic samples)."""
    return [prompts[(2 * i + 1) * len(prompts) // (2 * count)] for i in range(count)] if count else []


def traffic_sample(prompts: list[CapturedPrompt], count: int, client_share: float) -> list[CapturedPrompt]:
    """At most `count` of the time-ordered `prompts`, oldest first, where no client (API key) gives more than
    `client_share` of `count` (at least one): slots go to the clients in turn, and each client's prompts are taken
    evenly spread over its own captured window (`spread_over_time`). Prompts without a client (a server without
    keys) are one uncapped group. Fewer than `count` when the capped clients cannot fill it."""
    groups: dict[str | None, list[CapturedPrompt]] = {}
    for prompt in prompts:
        groups.setdefault(prompt.client, []).append(prompt)
    cap = max(1, math.floor(client_share * count))
    room = {client: len(group) if client is None else min(len(group), cap) for client, group in groups.items()}
    slots = dict.fromkeys(groups, 0)
    while sum(slots.values()) < count and any(slots[c] < room[c] for c in groups):
        for client in groups:
            if slots[client] < room[client] and sum(slots.values()) < count:
                slots[client] += 1
    taken = [p for client, group in groups.items() for p in spread_over_time(group, slots[client])]
    return sorted(taken, key=lambda p: p.time)


def traffic_config(config: RunConfig, traffic_dir: Path, stamp: str | None = None) -> tuple[RunConfig, dict]:
    """The config of a recalibration of `config` from the prompts captured in `traffic_dir`, and what it takes
    from them.

    Its run is `NAME-traffic-STAMP` (a folder of its own, next to the original run's), on the original run's
    merge, registered as the original run's model.
    """
    missing = [e.task for e in config.sources.experts if e.data is None or e.data.heldout is None]
    if missing:
        raise DartsError(f"tasks {missing} have no held-out data: a recalibration registers, and the alias moves "
                         "only on a held-out evaluation", "set sources.experts[...].data.heldout for each task")
    captured = read_traffic(traffic_dir, config.tasks)
    if not captured:
        raise DartsError(f"{traffic_dir} holds no captured prompt of the tasks {list(config.tasks)} (prompts no "
                         "correction answered are not kept)", "serve this config's model with capture on first")
    name = f"{config.name}-traffic-{stamp or time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    folder = config.output_dir / name / TRAFFIC_FOLDER
    folder.mkdir(mode=PRIVATE_FOLDER, parents=True, exist_ok=True)
    folder.chmod(PRIVATE_FOLDER)
    experts, used = [], {}
    for expert in config.sources.experts:
        prompts = captured.get(expert.task)
        if prompts:
            path = folder / f"{expert.task}.jsonl"
            taken = traffic_sample(prompts, traffic_count(config.calibration, len(prompts)),
                                   config.calibration.traffic_client_share)
            with atomic_file(path, mode=PRIVATE_FILE) as tmp:
                tmp.write_text("".join(json.dumps(traffic_row(p)) + "\n" for p in taken))
            expert = updated(expert, data=updated(expert.data, traffic=str(path)))
            used[expert.task] = len(taken)
        experts.append(expert)
    recalibration = updated(
        config, name=name, sources=updated(config.sources, experts=experts),
        merge=updated(config.merge, output=config.merged_dir),  # the same merge: reused, not merged again
        tracking=updated(config.tracking, registered_model=registered_model_name(config)),
    )
    share = config.calibration.traffic_share
    summary = {
        "from": str(Path(traffic_dir).absolute()),
        "share": share,
        "captured": {task: len(prompts) for task, prompts in captured.items()},
        "used": used,
        "client_share": config.calibration.traffic_client_share,
    }
    return recalibration, summary


def remove_traffic_copies(config: RunConfig) -> None:
    """Remove the recalibration's copies of the captured prompts (its run folder's TRAFFIC_FOLDER): the report says
    how many it took; the capture folder keeps the prompts under its own size cap."""
    shutil.rmtree(config.run_dir / TRAFFIC_FOLDER, ignore_errors=True)
