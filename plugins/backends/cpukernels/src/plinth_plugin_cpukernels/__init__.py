"""plinth backend plugin for CPUs: pre-packed GEMMs and a paged-decode attention kernel."""
