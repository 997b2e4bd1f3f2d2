"""The tuner service's policy: what a submitter may ask for (:mod:`optimizer.service.security`)."""
