"""Training: one optimizer step (step.py), checkpoints that reshard (checkpoint/), what a run
does around its steps (lifecycle.py), metrics (metrics.py), and checkpoint <-> Hugging Face
conversion (convert.py)."""
