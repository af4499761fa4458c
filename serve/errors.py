"""Error types the UI shows to the user as ``st.error`` instead of a stack trace."""

UserFacingErrors = (ValueError, RuntimeError, KeyError, TimeoutError)
