import sys

from dmuon.bench.cli import main

sys.exit(main())
