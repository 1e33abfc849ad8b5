"""The prefill role (TetriInfer §3.3): prefill-only chunks, then hand-off to a decode instance."""
