"""The communication plan: which collective carries each payload, and in what order rounds run;
the driver, the backends and the transports."""
