"""Parts both recipes share: the Grain loader, optimizer schedules, metric writers, run configs."""
