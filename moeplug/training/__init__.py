"""Training: optimizer + LR schedule, FLOPs/MFU, metrics, checkpoints, and the loop itself.

``trainer.train`` is the entry point; the CLI builds the pieces (plugins, data, model) and hands
them over, so the loop never constructs anything it could be given.
"""
