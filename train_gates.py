"""Train RLKV head gates with GRPO: `accelerate launch train_gates.py --config recipes/<name>.yaml [--field value ...]`.

A thin shim over `rlkv.trainers.script.main` (also `rlkv train`): the recipe fields, the output
folder rules and the error messages are documented there and in the README ("Training gates").
"""

import sys

from rlkv.trainers.script import (  # noqa: F401  (the script's names, for `import train_gates`)
    ScriptArguments,
    build_train_dataset,
    build_trainer,
    check_model_geometry,
    main,
    resolve_output_dir,
    train,
)

if __name__ == "__main__":
    sys.exit(main())
