"""Evaluation: one evaluator of bias, NLL and task scores that the pipeline and the ablation share; tables; plots."""
