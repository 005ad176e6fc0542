"""rtrain.worker: the library used inside a training script (`import rtrain` reaches its public
names, each loaded on first use). The torch-free modules (`settings`, `runtime`, `check_order`,
`trackers`) serve data-loading and launcher processes too; the rest import torch."""
