"""``deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME``: the file of variables the launcher exports to every
node. ``accelerate launch`` imports the name on its DeepSpeed path; zeroengine's launcher reads
``.zeroengine_env`` (written like DeepSpeed's ``.deepspeed_env``), so that is the name here."""
from zeroengine.launcher.commands import ENV_FILE_NAME as DEEPSPEED_ENVIRONMENT_NAME  # noqa: F401
