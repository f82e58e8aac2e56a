"""``python -m jaxamp compare ...``"""

import sys

from jaxamp._src.cli import main

sys.exit(main())
