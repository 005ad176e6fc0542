"""The torch side of `rtrain export`, run as `python -m rtrain.worker.export.convert`."""
