"""``python -m zeroengine.launcher`` is the ``zeroengine`` command."""
import sys

from .main import main

sys.exit(main())
