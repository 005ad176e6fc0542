"""Which rank is stuck at a hang: the rule, reading the ranks' boards and stacks, and PyTorch's
NCCL flight recorder."""
