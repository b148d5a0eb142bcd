"""megarl's on-disk checkpoint format, shared by the trainer and the converter.

- `files`: what a checkpoint directory holds (`megarl_model.json`, `trainer_state.json`), the
  errors, and the listing of a run's checkpoints;
- `vetting`: what is checked before megatron reads a directory (a safe `.metadata`, whole tensor
  files) and the newest complete checkpoint to resume from;
- `keys`: how a model's sharded state dict matches a checkpoint's tensor names;
- `reader`: `open_checkpoint` / `load_into`, the one reader of every megarl checkpoint;
- `writer`: `save_model_checkpoint`, one model as a converter checkpoint;
- `training`: run checkpoints (models with their optimizer states) saved and loaded.
"""
