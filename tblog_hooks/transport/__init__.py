"""One transfer per logged step: the device-to-host copy, the collectives of several ranks, and
the AMP loss scale that travels with the step."""
