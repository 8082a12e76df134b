import sys

from paged_jax.cli import main

sys.exit(main())
