"""`python -m evaluation ARGS`: lmms-eval's own command line, with the same arguments as
`python -m lmms_eval`, after reelflow's check of torchvision (models.torchvision_check).

lmms-eval imports torchvision at start-up (through Hugging Face `evaluate` and transformers). On a
machine with the CPU build of torch, pip's torchvision is a CUDA build that cannot load, and
`python -m lmms_eval` stops before any model runs, whatever the model. This entry hides such a
torchvision first (neither lmms-eval's core nor reelflow uses it) and then runs lmms-eval's CLI
unchanged; where torchvision loads (a GPU machine, or torchvision's CPU build from
download.pytorch.org), `python -m lmms_eval` is the same thing.

    python -m evaluation --model reelflow --model_args experiment=sparrow,model=toy_qwen \\
        --tasks reelflow_toy --include_path evaluation/tasks --log_samples --output_path outputs/lmms_eval
"""

import sys

import models  # noqa: F401  (hides an unloadable torchvision before lmms-eval imports transformers)

if __name__ == "__main__":
    from lmms_eval.cli.dispatch import main

    main()
    sys.exit(0)
