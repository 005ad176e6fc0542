"""The training state in checkpoint files and back, for saving and restoring alike: each
component (model, optimizer, RNG, ...) as tensors and JSON, tensors as safetensors blobs, a
torch.distributed checkpoint loaded without unpickling, the host memory a file is read into."""
