"""Output-length prediction (TetriInfer §3.3.2): datasets, predictors, training, serving.

Light on purpose: importing the package (or `buckets`, `base`, `serving`, `cli`) loads no torch;
the predictor kinds import torch and transformers when they are used. See
`docs/length_predictor.md` for the workflow and the measured results.
"""
