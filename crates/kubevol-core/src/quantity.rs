//! Kubernetes resource quantities (`64Mi`, `1G`, `500m`, `1e3`), parsed exactly.
//!
//! The grammar is the API server's: `<sign><digits>[.<digits>]<suffix>` where the suffix is a
//! binary SI unit (Ki … Ei), a decimal SI unit (n, u, m, "", k, M, G, T, P, E) or a decimal
//! exponent (`e3`, `E-2`). [`Quantity::value`] rounds up to a whole number, as `Quantity.Value()`
//! does, because a size limit that is rounded down would cut a byte off what the user asked for.

use std::fmt;

/// Why a string is not a quantity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// The string does not follow the grammar.
    #[error("quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")]
    Syntax,
    /// The value does not fit in 64 bits once scaled.
    #[error("quantity is too large")]
    TooLarge,
}

/// A parsed quantity: `numerator / 10^scale_down`, before rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quantity {
    negative: bool,
    /// The value multiplied by `10^decimals`.
    scaled: u128,
    decimals: u32,
}

const MAX_EXACT: u128 = i64::MAX as u128;

impl Quantity {
    /// Parses a quantity string.
    pub fn parse(s: &str) -> Result<Quantity, QuantityError> {
        let s = s.trim();
        let (negative, rest) = match s.as_bytes().first() {
            Some(b'-') => (true, &s[1..]),
            Some(b'+') => (false, &s[1..]),
            _ => (false, s),
        };
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, suffix) = rest.split_at(num_end);
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return Err(QuantityError::Syntax);
        }
        let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
        let mut scaled: u128 = 0;
        for d in int_part.bytes().chain(frac_part.bytes()) {
            scaled = scaled
                .checked_mul(10)
                .and_then(|v| v.checked_add(u128::from(d - b'0')))
                .ok_or(QuantityError::TooLarge)?;
        }
        let mut decimals = u32::try_from(frac_part.len()).map_err(|_| QuantityError::TooLarge)?;

        // (multiplier, power of ten to divide by)
        let (mul, div_pow): (u128, u32) = match suffix {
            "" => (1, 0),
            "Ki" => (1 << 10, 0),
            "Mi" => (1 << 20, 0),
            "Gi" => (1 << 30, 0),
            "Ti" => (1 << 40, 0),
            "Pi" => (1 << 50, 0),
            "Ei" => (1 << 60, 0),
            "n" => (1, 9),
            "u" => (1, 6),
            "m" => (1, 3),
            "k" => (1_000, 0),
            "M" => (1_000_000, 0),
            "G" => (1_000_000_000, 0),
            "T" => (1_000_000_000_000, 0),
            "P" => (1_000_000_000_000_000, 0),
            "E" => (1_000_000_000_000_000_000, 0),
            exp if exp.starts_with(['e', 'E']) => {
                let e: i32 = exp[1..].parse().map_err(|_| QuantityError::Syntax)?;
                if !exp[1..]
                    .trim_start_matches(['+', '-'])
                    .bytes()
                    .all(|b| b.is_ascii_digit())
                {
                    return Err(QuantityError::Syntax);
                }
                if e >= 0 {
                    let e = u32::try_from(e).map_err(|_| QuantityError::TooLarge)?;
                    (10u128.checked_pow(e).ok_or(QuantityError::TooLarge)?, 0)
                } else {
                    (1, e.unsigned_abs())
                }
            }
            _ => return Err(QuantityError::Syntax),
        };
        scaled = scaled.checked_mul(mul).ok_or(QuantityError::TooLarge)?;
        decimals = decimals
            .checked_add(div_pow)
            .ok_or(QuantityError::TooLarge)?;
        let q = Quantity {
            negative: negative && scaled != 0,
            scaled,
            decimals,
        };
        if q.ceil_abs().is_none() {
            return Err(QuantityError::TooLarge);
        }
        Ok(q)
    }

    fn ceil_abs(&self) -> Option<u128> {
        if self.decimals > 38 {
            return Some(u128::from(self.scaled != 0));
        }
        let div = 10u128.pow(self.decimals);
        let v = self.scaled.div_ceil(div);
        (v <= MAX_EXACT).then_some(v)
    }

    /// Whether the quantity is below zero.
    pub fn is_negative(&self) -> bool {
        self.negative
    }

    /// Whether the quantity is exactly zero.
    pub fn is_zero(&self) -> bool {
        self.scaled == 0
    }

    /// The value rounded up to a whole number (away from zero for positive values).
    pub fn value(&self) -> i64 {
        let abs = self.ceil_abs().unwrap_or(MAX_EXACT) as i64;
        if self.negative {
            -abs
        } else {
            abs
        }
    }

    /// The value in thousandths, rounded up (how the kubelet compares CPU quantities).
    pub fn milli_value(&self) -> i64 {
        let q = Quantity {
            scaled: self.scaled.saturating_mul(1000),
            ..*self
        };
        q.value()
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.value())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units_exactly() {
        let rows: &[(&str, i64)] = &[
            ("64Mi", 64 << 20),
            ("1Gi", 1 << 30),
            ("1G", 1_000_000_000),
            ("1k", 1000),
            ("1.5Gi", 3 << 29),
            ("100", 100),
            ("+7", 7),
            ("1e3", 1000),
            ("1E3", 1000),
            ("0.5", 1),
            ("500m", 1),
            ("1500m", 2),
            ("1e-2", 1),
            ("0", 0),
            ("0.0", 0),
            ("-1Ki", -1024),
            ("2Ei", 2 << 60),
            ("3Ti", 3 << 40),
            ("3Pi", 3 << 50),
            ("3T", 3_000_000_000_000),
            ("3P", 3_000_000_000_000_000),
            ("3E", 3_000_000_000_000_000_000),
            ("1500000000n", 2),
            ("1500000u", 2),
            ("1e-39", 1),
            ("0e-39", 0),
        ];
        for (s, want) in rows {
            let q = Quantity::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"));
            assert_eq!(q.value(), *want, "row {s}");
        }
    }

    #[test]
    fn displays_its_value() {
        for (s, shown) in [("1Ki", "1024"), ("1500m", "2"), ("-2k", "-2000")] {
            assert_eq!(Quantity::parse(s).unwrap().to_string(), shown, "row {s}");
        }
    }

    #[test]
    fn rejects_malformed() {
        for s in [
            "", "Mi", "1.2.3", "1Xi", "1 Mi", "--1", "1e", "e3", ".", "1mi", "1e+-3",
        ] {
            assert!(Quantity::parse(s).is_err(), "row {s:?} must be rejected");
        }
    }

    #[test]
    fn rejects_values_beyond_int64() {
        assert_eq!(Quantity::parse("16Ei"), Err(QuantityError::TooLarge));
        assert_eq!(Quantity::parse("1e40"), Err(QuantityError::TooLarge));
    }

    #[test]
    fn milli_values_round_up() {
        assert_eq!(Quantity::parse("250m").unwrap().milli_value(), 250);
        assert_eq!(Quantity::parse("1").unwrap().milli_value(), 1000);
        assert_eq!(Quantity::parse("0.0001").unwrap().milli_value(), 1);
    }

    #[test]
    fn sign_and_zero() {
        assert!(Quantity::parse("-5").unwrap().is_negative());
        assert!(!Quantity::parse("-0").unwrap().is_negative());
        assert!(Quantity::parse("0Mi").unwrap().is_zero());
    }
}
