import sys

from flexsarathi.cli import main

sys.exit(main())
