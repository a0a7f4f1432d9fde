import sys

from h2jax.cli import main

sys.exit(main())
