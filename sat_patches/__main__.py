from .cli import exit_now
from .cli.main import main

exit_now(main())
