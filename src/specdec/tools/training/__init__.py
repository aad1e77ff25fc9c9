"""Recipes that make models: a corpus (corpus.py), the shared training loop with its
checkpoints (loop.py), `specdec train` (train.py), `specdec distill` (distill.py) and their
command-line parsers (commands.py)."""
