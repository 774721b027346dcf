"""Model families written where users write theirs: outside the installed packages, registered through the public
API when a test imports them."""
