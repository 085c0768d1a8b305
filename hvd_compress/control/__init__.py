"""Control: adaptive controllers that choose compression settings, and the services that agree on them."""
