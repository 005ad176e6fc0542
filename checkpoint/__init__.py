"""rtrain.checkpoint: the checkpoint format, torch-free: names on disk, the manifest, hashes and
signatures, encryption, safetensors files, the commit protocol, verification and verified reads,
the memory tier's parts.

Both halves use it: the worker writes checkpoints with it and restores from them, the supervisor
picks the one to resume from, and `rtrain inspect` / `prune` / `export` read it, all without
importing torch. It imports neither half: only the foundations both share
(`rtrain.supervisor.core`: errors, the protocol's names, file modes, atomic writes)."""
