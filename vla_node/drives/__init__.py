"""Drives in and out: open (native MCAP, ROS 2 bags, mp4), convert, synthetic, record, replay, demo."""
