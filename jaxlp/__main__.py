import sys

from jaxlp.cli import main

sys.exit(main())
