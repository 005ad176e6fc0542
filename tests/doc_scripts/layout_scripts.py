"""Stands in for the scripts docs/foreign.md names with a checkpoint layout of their own:
imagenet's `main.py`, timm's and DeepSpeed's, Composer's and torchtitan's `train.py`, accelerate's
`checkpointing.py`. Which one it is follows from the arguments the page passes (timm's
--experiment, accelerate's --output_dir, DeepSpeed's --save_dir, Composer's --save_folder,
torchtitan's --dump_folder; else imagenet, saving in the working dir); the saves are written by
tests/children/layouts_train.py (copied in beside it), two epochs, as each library writes them.
The kills and resumes are tested in tests/test_foreign_layouts_launch.py."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import layouts_train  # beside this file, once copied in


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-a", "--arch")
    p.add_argument("data", nargs="?")
    p.add_argument("--resume", "--resume_from_checkpoint", "--load_path", dest="resume",
                   default="")
    for flag in ("--data-dir", "--model", "--output", "--experiment", "--checkpointing_steps",
                 "--output_dir", "--save_dir", "--save_folder", "--dump_folder"):
        p.add_argument(flag)
    a = p.parse_args()
    if a.experiment:
        layout, out = "timm", os.path.join(a.output or "output", "train", a.experiment)
    elif a.output_dir:
        layout, out = "accelerate", a.output_dir
    elif a.save_dir:
        layout, out = "deepspeed", a.save_dir
    elif a.save_folder:
        layout, out = "composer", a.save_folder
    elif a.dump_folder:
        layout, out = "dcp", os.path.join(a.dump_folder, "checkpoint")
    else:
        layout, out = "imagenet", "."
    sys.argv = [sys.argv[0], "--layout", layout, "--out_dir", out, "--epochs", "2",
                *(["--resume", a.resume] if a.resume else [])]
    layouts_train.main()


if __name__ == "__main__":
    main()
