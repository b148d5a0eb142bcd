"""The RL loop (`loop.train`), the run it drives (`run.Run`), the update, checkpoints and resume."""
