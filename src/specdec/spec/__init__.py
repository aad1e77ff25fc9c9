"""The speculative round and what it is made of: each row's k (k_choice.py, by goodput:
goodput.py), the round itself (round.py: propose -> verify forward -> accept -> keep the
branch), and rejection sampling (verify.py: pure functions of token ids and probabilities).

Nothing here holds requests or caches: the engine (engine/) hands a round its batch of
sequences, and the runner (worker/) owns the caches the round's forwards write."""
