"""python -m pdmesh ... == pdmesh ..."""
import sys

from pdmesh.cli import main

sys.exit(main())
