//! Placeholder: being written (RDP accountant).
