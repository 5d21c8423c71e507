"""Device statistics: the record kinds with their statistic names and tags, the reductions,
histogram sampling and binning, and packing a logged step into one tensor."""
