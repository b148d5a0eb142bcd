"""Trajectories of turns between the policy and an environment, token-exact: each trajectory a
thread (`trajectory`, its tokens never re-tokenized: `chat_format`), what they start from and
are driven by (`sources`), the schedulers that serve their turns (`batcher`: the shared
trajectory side; `waves`, `stream`) and the runner over a small generator protocol (`runner`).
Knows no engine and no placement.
"""
