//! CPython's location table (`co_linetable`), the same format from 3.11
//! to 3.14 (`Objects/locations.md`).

/// The line of code unit `index` from a CPython 3.11+ location table
/// (`Objects/locations.md`): entries of `(byte & 7) + 1` code units whose
/// code `(byte >> 3) & 15` says how the line changes.
pub fn line_of(table: &[u8], firstlineno: i32, index: u64) -> Option<i32> {
    let mut line = firstlineno;
    let mut addr = 0u64;
    let mut i = 0usize;
    while i < table.len() {
        let b = table[i];
        if b & 0x80 == 0 {
            return None;
        }
        i += 1;
        let code = (b >> 3) & 15;
        let len = u64::from(b & 7) + 1;
        let varint = |i: &mut usize| -> Option<u32> {
            let mut v = 0u32;
            let mut shift = 0;
            loop {
                let c = *table.get(*i)?;
                *i += 1;
                v |= u32::from(c & 63).checked_shl(shift)?;
                if c & 64 == 0 {
                    return Some(v);
                }
                shift += 6;
            }
        };
        let svarint = |v: u32| -> i32 {
            if v & 1 == 1 {
                -((v >> 1) as i32)
            } else {
                (v >> 1) as i32
            }
        };
        let mut this_line = Some(line);
        match code {
            15 => this_line = None,
            14 => {
                line = line.wrapping_add(svarint(varint(&mut i)?));
                this_line = Some(line);
                varint(&mut i)?;
                varint(&mut i)?;
                varint(&mut i)?;
            }
            13 => {
                line = line.wrapping_add(svarint(varint(&mut i)?));
                this_line = Some(line);
            }
            10..=12 => {
                line = line.wrapping_add(i32::from(code) - 10);
                this_line = Some(line);
                i += 2;
            }
            _ => i += 1,
        }
        if index < addr + len {
            return this_line;
        }
        addr += len;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn location_table_lines() {
        // firstlineno 10. Entry 1: code 13 (no columns), +1 line, 2 units.
        // Entry 2: code 11 (one-line form, +1), 1 unit, two column bytes.
        // Entry 3: code 14 (long form), -2 lines, 3 units.
        // Entry 4: code 15 (no location), 1 unit.
        let table = [
            0x80 | (13 << 3) | 1,
            2, // svarint +1
            0x80 | (11 << 3),
            0,
            0,
            0x80 | (14 << 3) | 2,
            5, // svarint -2
            0,
            0,
            0,
            0x80 | (15 << 3),
        ];
        assert_eq!(line_of(&table, 10, 0), Some(11));
        assert_eq!(line_of(&table, 10, 1), Some(11));
        assert_eq!(line_of(&table, 10, 2), Some(12));
        assert_eq!(line_of(&table, 10, 3), Some(10));
        assert_eq!(line_of(&table, 10, 5), Some(10));
        assert_eq!(line_of(&table, 10, 6), None);
        assert_eq!(line_of(&table, 10, 7), None);
        // Garbage: no entry marker.
        assert_eq!(line_of(&[0x01, 0x02], 10, 0), None);
    }
}
