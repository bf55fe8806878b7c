"""Moved to `trustclip.metric_names` (the bottom layer, shared by every integration); kept for old imports."""

from trustclip.metric_names import *  # noqa: F403
from trustclip.metric_names import logged_names, objective_name  # noqa: F401
