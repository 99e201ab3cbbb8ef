import sys

from elastic_trainer.cli import main

sys.exit(main())
