"""Multi-turn rollouts: the user's environment in worker processes (worker.py), tool calls read from the model's
turns in the checkpoint's own format (tool_calls.py), and the conversation loop that renders each turn with the
chat template and keeps only the model's tokens for training (conversation.py)."""
