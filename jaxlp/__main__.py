import sys

from jaxlp._entry import main

sys.exit(main())
