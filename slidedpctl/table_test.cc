#include "slidedpctl/table.h"

#include <string>

#include "gtest/gtest.h"

namespace slidedp::ctl {
namespace {

using Align = Table::Align;

TEST(TableTest, PadsToWidestCellAndAlignsByColumn) {
  Table table({{"NAME", Align::kLeft}, {"SIZE", Align::kRight}, {"NOTE", Align::kLeft}});
  table.AddRow({"a", "1.0 KiB", "x"});
  table.AddRow({"longer-name", "12 B", ""});
  EXPECT_EQ(table.ToString(),
            "NAME            SIZE  NOTE\n"
            "a            1.0 KiB  x\n"
            "longer-name     12 B\n");
}

TEST(TableTest, HeaderWiderThanCells) {
  Table table({{"LAYER", Align::kRight}, {"N", Align::kLeft}});
  table.AddRow({"0", "a"});
  EXPECT_EQ(table.ToString(), "LAYER  N\n    0  a\n");
}

TEST(TableTest, KeyValueHasNoHeader) {
  Table table = Table::KeyValue();
  table.AddRow({"uptime", "3.2s"});
  table.AddRow({"instance", "default"});
  EXPECT_EQ(table.ToString(), "uptime    3.2s\ninstance  default\n");
}

TEST(TableTest, ShortRowsArePaddedAndLongRowsTruncated) {
  Table table({{"A", Align::kLeft}, {"B", Align::kLeft}});
  table.AddRow({"1"});
  table.AddRow({"2", "3", "dropped"});
  EXPECT_EQ(table.num_rows(), 2u);
  EXPECT_EQ(table.ToString(), "A  B\n1\n2  3\n");
}

TEST(TableTest, WidthCountsCodePointsNotBytes) {
  EXPECT_EQ(DisplayWidth("naïve"), 5u);
  Table table({{"NAME", Align::kLeft}, {"X", Align::kLeft}});
  table.AddRow({"naïve", "1"});
  table.AddRow({"plain", "2"});
  const std::string text = table.ToString();
  EXPECT_NE(text.find("naïve  1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("plain  2\n"), std::string::npos) << text;
}

TEST(TableTest, EmptyTablePrintsHeaderOnly) {
  Table table({{"KEY", Align::kLeft}, {"VALUE", Align::kLeft}});
  EXPECT_EQ(table.ToString(), "KEY  VALUE\n");
}

}  // namespace
}  // namespace slidedp::ctl
