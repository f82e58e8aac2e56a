"""``python -m jaxamp compare ...``"""

import sys

from jaxamp._src.compare.cli import main

sys.exit(main())
