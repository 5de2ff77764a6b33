"""The road simulator: a road, its scenery and traffic, a car with a kinematic bicycle model and a forward camera, the expert driver, instructions and how a drive went (pure numpy; no torch)."""
