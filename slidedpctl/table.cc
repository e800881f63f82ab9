#include "slidedpctl/table.h"

#include <algorithm>
#include <sstream>
#include <utility>

namespace slidedp::ctl {
namespace {

constexpr char kColumnSeparator[] = "  ";

void AppendPadded(const std::string& cell, size_t width, Table::Align align, std::string* line) {
  const size_t pad = width - std::min(width, DisplayWidth(cell));
  if (align == Table::Align::kRight) line->append(pad, ' ');
  line->append(cell);
  if (align == Table::Align::kLeft) line->append(pad, ' ');
}

}  // namespace

size_t DisplayWidth(const std::string& text) {
  // Continuation bytes (10xxxxxx) do not start a code point.
  return static_cast<size_t>(std::count_if(text.begin(), text.end(), [](char c) {
    return (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  }));
}

Table::Table(std::vector<Column> columns) : columns_(std::move(columns)) {}

Table Table::KeyValue() {
  Table table({{"KEY", Align::kLeft}, {"VALUE", Align::kLeft}});
  table.set_show_header(false);
  return table;
}

void Table::AddRow(std::vector<std::string> cells) {
  cells.resize(columns_.size());
  rows_.push_back(std::move(cells));
}

void Table::Print(std::ostream& out) const {
  std::vector<size_t> widths(columns_.size(), 0);
  for (size_t c = 0; c < columns_.size(); ++c) {
    if (show_header_) widths[c] = DisplayWidth(columns_[c].header);
    for (const auto& row : rows_) widths[c] = std::max(widths[c], DisplayWidth(row[c]));
  }
  auto print_line = [&](auto&& cell_at) {
    std::string line;
    for (size_t c = 0; c < columns_.size(); ++c) {
      if (c > 0) line.append(kColumnSeparator);
      AppendPadded(cell_at(c), widths[c], columns_[c].align, &line);
    }
    line.erase(line.find_last_not_of(' ') + 1);
    out << line << '\n';
  };
  if (show_header_) {
    print_line([&](size_t c) -> const std::string& { return columns_[c].header; });
  }
  for (const auto& row : rows_) {
    print_line([&](size_t c) -> const std::string& { return row[c]; });
  }
}

std::string Table::ToString() const {
  std::ostringstream out;
  Print(out);
  return out.str();
}

}  // namespace slidedp::ctl
