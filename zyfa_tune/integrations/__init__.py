"""Adapters that plug zyfa-tune's attention into other libraries' models. Each adapter imports its
library only when called, so `zyfa_tune` installs and imports without any of them."""
