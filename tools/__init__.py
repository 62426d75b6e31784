"""Maintenance scripts run from the repository root as modules (not part of the installed
package), e.g. `python -m tools.gen_options --write`."""
