import sys

from slipstream.cli.main import main

sys.exit(main())
