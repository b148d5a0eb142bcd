"""Where the engines run. `colocated`: an engine in every trainer rank; `separate`: engines on
ranks of their own, driven over a link (`engine_rank` on those ranks). Both drive one
`worker.RolloutWorker` per engine (generation, per-token versions, in-flight updates) and cut
and merge a step's prompts the same way (`shares`; the colocated engines' groups: `dispatch`).
"""
