import sys

from flexsarathi.cli.main import main

sys.exit(main())
