"""``python -m zeroengine.checkpoint SAVE_DIR OUT`` is ``ze_to_fp32 SAVE_DIR OUT``."""
import sys

from .consolidate import main

sys.exit(main())
