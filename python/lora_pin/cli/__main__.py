"""``python -m lora_pin.cli``: the same as the ``lora-pin`` command."""

import sys

from lora_pin.cli import main

sys.exit(main())
