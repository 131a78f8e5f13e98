"""``python -m colossalai.cli`` == the ``colossalai`` command."""

import sys

from colossalai.cli.main import main

sys.exit(main())
